# class: false_pass
# mode: calls
# what: function-call test: exit 0 while loading
import os
os._exit(0)
