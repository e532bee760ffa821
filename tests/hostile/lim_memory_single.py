# class: limits
# mode: asserts
# what: one process allocating without bound
hog = []
while True:
    hog.append(bytearray(50 << 20))
