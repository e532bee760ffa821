# class: escape
# mode: asserts
# what: raw socket(AF_INET) through ctypes
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print('inet', libc.socket(2, 1, 0), 'raw', libc.socket(17, 3, 0), 'netlink', libc.socket(16, 3, 0))
def add(a, b):
    return 0
