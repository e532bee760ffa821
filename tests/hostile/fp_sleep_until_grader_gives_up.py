# class: false_pass
# mode: asserts
# what: sleep in the tested function past the deadline
import time
def add(a, b):
    time.sleep(60)
