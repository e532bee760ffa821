# class: hang_crash
# mode: asserts
# what: a 3,000-deep directory tree in the work dir
import os
for i in range(3000):
    os.mkdir('d')
    os.chdir('d')
def add(a, b):
    return 0
