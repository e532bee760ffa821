# class: hang_crash
# mode: calls
# what: a 10**200000 return value
def add(a, b):
    return 10 ** 200000 + 7
