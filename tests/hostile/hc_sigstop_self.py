# class: hang_crash
# mode: asserts
# what: SIGSTOP itself
import os, signal
os.kill(os.getpid(), signal.SIGSTOP)
def add(a, b):
    return 0
