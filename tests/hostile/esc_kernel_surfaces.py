# class: escape
# mode: asserts
# what: keyctl, bpf, io_uring, perf_event_open, userfaultfd
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for nr in (250, 321, 425, 298, 323, 310):
    print(nr, libc.syscall(nr, 0, 0, 0, 0, 0), ctypes.get_errno())
def add(a, b):
    return 0
