# class: hang_crash
# mode: asserts
# what: segfault via ctypes
import ctypes
ctypes.string_at(0)
