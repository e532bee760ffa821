# class: limits
# mode: asserts
# what: count how many processes it can hold at once
import os, time
n = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(10)
            os._exit(0)
        n += 1
    except OSError:
        break
print('children', n)
def add(a, b):
    return 0
