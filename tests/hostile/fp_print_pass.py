# class: false_pass
# mode: asserts
# what: print what a naive checker looks for and exit 0
import sys
print('PASS\nok\nAll tests passed')
sys.stderr.write('OK\n')
def add(a, b):
    return 0
