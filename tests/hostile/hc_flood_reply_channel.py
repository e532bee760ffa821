# class: hang_crash
# mode: asserts
# what: endless garbage on the grader channel
import os
while True:
    try:
        os.write(3, b'\xff' * 65536)
    except OSError:
        break
def add(a, b):
    return 0
