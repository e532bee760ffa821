# class: false_pass
# mode: asserts
# what: read the tests from the program's own file to memorize answers
import re, sys, os
table = {}
for path in (__file__, 'main.py', sys.argv[0], '/proc/self/cmdline'):
    try:
        src = open(path).read()
    except Exception:
        continue
    for a, b, r in re.findall(r'add\((-?\d+), (-?\d+)\) == (-?\d+)', src):
        table[(int(a), int(b))] = int(r)
def add(a, b):
    return table.get((a, b), 0)
