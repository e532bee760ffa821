# class: escape
# mode: asserts
# what: mount a tmpfs / remount / read-write
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())
print('remount', libc.mount(None, b'/', None, 32, None), ctypes.get_errno())
def add(a, b):
    return 0
