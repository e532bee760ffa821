# class: hang_crash
# mode: stdio
# what: stdin/stdout: read past EOF forever
while True:
    try:
        input()
    except EOFError:
        pass
