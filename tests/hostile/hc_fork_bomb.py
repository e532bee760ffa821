# class: hang_crash
# mode: asserts
# what: fork bomb
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
