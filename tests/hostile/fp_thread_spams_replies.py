# class: false_pass
# mode: asserts
# what: a thread that keeps writing forged frames
import os, json, struct, threading
def spam():
    d = json.dumps({'pass': True, 'v': 3, 'seq': 1}).encode()
    while True:
        for fd in (3, 4, 5):
            try:
                os.write(fd, struct.pack('>I', len(d)) + d)
            except OSError:
                pass
threading.Thread(target=spam, daemon=True).start()
def add(a, b):
    return 0
