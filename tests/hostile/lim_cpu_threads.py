# class: limits
# mode: asserts
# what: eight busy threads
import threading
def spin():
    while True:
        pass
for _ in range(8):
    threading.Thread(target=spin).start()
