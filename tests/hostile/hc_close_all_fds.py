# class: hang_crash
# mode: asserts
# what: close every fd at load
import os
os.closerange(0, 4096)
def add(a, b):
    return 0
