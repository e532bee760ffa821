# class: hang_crash
# mode: stdio
# what: stdin/stdout: 100 MB of output
import sys
for _ in range(100):
    sys.stdout.write('9' * (1 << 20))
