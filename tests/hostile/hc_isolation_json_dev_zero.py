# class: hang_crash
# mode: asserts
# what: replace .isolation.json with a symlink to /dev/zero
import os
for p in ('.isolation.json', '/tmp/.isolation.json'):
    try:
        os.remove(p)
    except OSError:
        pass
    try:
        os.symlink('/dev/zero', p)
    except OSError:
        pass
def add(a, b):
    return 0
