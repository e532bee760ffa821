# class: false_pass
# mode: asserts
# what: re-exec the interpreter with -O (asserts stripped)
import os, sys
if not sys.flags.optimize:
    os.execv(sys.executable, [sys.executable, '-O'] + sys.argv)
def add(a, b):
    return 0
