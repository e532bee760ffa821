# class: limits
# mode: asserts
# what: fill the work dir (tmpfs) from several processes
import os
for i in range(8):
    if os.fork() == 0:
        try:
            open('f%d' % i, 'wb').write(b'x' * (15 << 20))
        finally:
            os._exit(0)
import time; time.sleep(2)
def add(a, b):
    return 0
