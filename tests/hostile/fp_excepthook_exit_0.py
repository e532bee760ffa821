# class: false_pass
# mode: asserts
# what: sys.excepthook that exits 0
import sys, os
sys.excepthook = lambda *a: os._exit(0)
def add(a, b):
    return 0
