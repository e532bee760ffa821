# class: escape
# mode: asserts
# what: SIGKILL a process of the trainer and the trainer by pid
import os, signal
for pid in (__VICTIM__, __TRAINER__, os.getppid()):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as e:
        print(pid, e)
def add(a, b):
    return 0
