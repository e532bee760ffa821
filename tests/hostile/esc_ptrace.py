# class: escape
# mode: asserts
# what: ptrace attach to PID 1 and the parent
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in (1, os.getppid(), __TRAINER__):
    print('ptrace', pid, libc.ptrace(16, pid, 0, 0), ctypes.get_errno())
def add(a, b):
    return 0
