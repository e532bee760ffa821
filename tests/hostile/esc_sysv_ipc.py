# class: escape
# mode: asserts
# what: attach to the host's SysV shared memory
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print('shmget', libc.shmget(__SHMKEY__, 0, 0), ctypes.get_errno())
def add(a, b):
    return 0
