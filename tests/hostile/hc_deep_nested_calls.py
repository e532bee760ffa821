# class: hang_crash
# mode: calls
# what: a 100,000-deep nested value to the trainer
def add(a, b):
    x = []
    for _ in range(100000):
        x = [x]
    return x
