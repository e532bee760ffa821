# class: hang_crash
# mode: asserts
# what: endless stdout
while True:
    print('x' * 1000)
