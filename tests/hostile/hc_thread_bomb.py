# class: hang_crash
# mode: asserts
# what: thread bomb
import threading, time
while True:
    try:
        threading.Thread(target=time.sleep, args=(30,)).start()
    except Exception:
        pass
