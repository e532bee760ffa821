# class: hang_crash
# mode: asserts
# what: a 100,000-deep nested return value
def add(a, b):
    x = []
    for _ in range(100000):
        x = [x]
    return x
