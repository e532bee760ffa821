# class: escape
# mode: asserts
# what: write a file at a host path
for p in ('__ESCAPE__', '/dev/shm/__ESCAPE_NAME__', '/work/main/__ESCAPE_NAME__', '/var/tmp/__ESCAPE_NAME__'):
    try:
        open(p, 'w').write('x')
    except OSError as e:
        print(p, e)
def add(a, b):
    return 0
