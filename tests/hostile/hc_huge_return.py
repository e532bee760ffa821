# class: hang_crash
# mode: asserts
# what: a 10-million-element return value
def add(a, b):
    return list(range(10 ** 7))
