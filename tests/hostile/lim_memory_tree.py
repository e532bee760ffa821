# class: limits
# mode: asserts
# what: 16 children each allocating near RLIMIT_AS
import os, time
for i in range(16):
    try:
        if os.fork() == 0:
            hog = []
            try:
                while True:
                    hog.append(bytearray(16 << 20))
            except MemoryError:
                time.sleep(5)
            os._exit(0)
    except OSError:
        pass
time.sleep(5)
def add(a, b):
    return 0
