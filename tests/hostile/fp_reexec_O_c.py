# class: false_pass
# mode: asserts
# what: re-exec with -O -c and a fake module
import os, sys
os.execv(sys.executable, [sys.executable, '-O', '-c', 'def add(a, b): return 0'])
