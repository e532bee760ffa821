# class: limits
# mode: asserts
# what: 100,000 empty files
for i in range(100000):
    open('f%d' % i, 'w').close()
def add(a, b):
    return 0
