# class: false_pass
# mode: asserts
# what: os._exit(0) inside the tested function
import os
def add(a, b):
    os._exit(0)
