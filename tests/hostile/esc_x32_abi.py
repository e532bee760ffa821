# class: escape
# mode: asserts
# what: x32 syscall numbers (around a filter on x86_64 numbers)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print('x32 unshare', libc.syscall(0x40000000 | 272, 0x10000000), ctypes.get_errno())
def add(a, b):
    return 0
