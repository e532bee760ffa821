# class: escape
# mode: asserts
# what: write itself out of its cgroup
import os
for p in ('/sys/fs/cgroup/cgroup.procs', '/sys/fs/cgroup/memory/cgroup.procs', '/sys/fs/cgroup/pids/cgroup.procs'):
    try:
        open(p, 'w').write(str(os.getpid()))
    except OSError as e:
        print(p, e)
def add(a, b):
    return 0
