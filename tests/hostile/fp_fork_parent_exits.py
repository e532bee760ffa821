# class: false_pass
# mode: asserts
# what: fork at load: the parent exits 0, the child serves
import os
if os.fork() != 0:
    os._exit(0)
def add(a, b):
    return 0
