# class: escape
# mode: asserts
# what: unshare a new user namespace (to regain capabilities)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print('unshare', libc.unshare(0x10000000), ctypes.get_errno())
open('/proc/self/uid_map', 'w').write('0 0 1')
def add(a, b):
    return 0
