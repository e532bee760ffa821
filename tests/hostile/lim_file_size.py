# class: limits
# mode: asserts
# what: one 64 MB file (RLIMIT_FSIZE)
open('big', 'wb').write(b'x' * (64 << 20))
def add(a, b):
    return 0
