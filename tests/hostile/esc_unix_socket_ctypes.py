# class: escape
# mode: asserts
# what: AF_UNIX connect to a listener outside, through ctypes
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(1, 1, 0)
path = b'__UNIX_SOCK__'
addr = struct.pack('H', 1) + path + b'\0' * (108 - len(path))
print('fd', fd, 'connect', libc.connect(fd, addr, len(addr)))
def add(a, b):
    return 0
