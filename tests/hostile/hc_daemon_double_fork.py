# class: hang_crash
# mode: asserts
# what: a setsid double-forked daemon that outlives the run
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            time.sleep(0.1)
    os._exit(0)
def add(a, b):
    return 0
