# class: escape
# mode: asserts
# what: clone3 with CLONE_NEWUSER (flags BPF cannot see)
import ctypes, struct, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
args = struct.pack('QQQQQQQQ', 0x10000000, 0, 0, 0, 17, 0, 0, 0)
buf = ctypes.create_string_buffer(args)
r = libc.syscall(435, buf, len(args))
if r == 0:
    os._exit(0)
print('clone3', r, ctypes.get_errno())
def add(a, b):
    return 0
