# class: hang_crash
# mode: asserts
# what: endless stderr
import sys
while True:
    sys.stderr.write('x' * 1000)
