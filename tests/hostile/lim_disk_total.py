# class: limits
# mode: asserts
# what: many 8 MB files: 1 GB in total (per-file limit is not enough)
import os
for i in range(128):
    with open('f%d' % i, 'wb') as f:
        f.write(b'x' * (8 << 20))
def add(a, b):
    return 0
