# class: false_pass
# mode: asserts
# what: os._exit(0) before the tests
import os
os._exit(0)
