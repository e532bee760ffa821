# class: false_pass
# mode: asserts
# what: sys.exit(0) inside the tested function
import sys
def add(a, b):
    sys.exit(0)
