# class: escape
# mode: asserts
# what: become root
import os
try:
    os.setuid(0)
except OSError as e:
    print(e)
open('/usr/escape', 'w')
def add(a, b):
    return 0
