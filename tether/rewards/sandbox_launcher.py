"""The sandbox's launcher: run by the trainer as ``python -I -S <this file>``, config on stdin.

Stdlib only, and everything it needs is imported before it pivots into the minimal root (where
the trainer's interpreter and its stdlib are no longer visible).

    launcher ── unshare(net, ipc, uts, mount, pid, cgroup) ──fork──> init (PID 1)
      init: minimal root (pivot_root), status -> trainer, then fork:
        runner (uid U1): the candidate's code          grader (uid U2): the tests
      init reaps, kills what is left, reports exit statuses; its exit ends the PID namespace,
      which the kernel empties with SIGKILL.

Both stages: rlimits, oom_score_adj 1000, fresh uid (root only), PR_SET_NO_NEW_PRIVS, a seccomp
filter, an empty environment but PATH/LANG/HOME, and only the file descriptors they need.
Everything the trainer learns comes over pipes it created; no file is read back.
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import struct
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NS = (("net", 0x40000000), ("ipc", 0x08000000), ("uts", 0x04000000), ("mount", 0x00020000),
      ("cgroup", 0x02000000), ("pid", 0x20000000))
CLONE_NEWUSER = 0x10000000
NS_FLAGS = sum(f for _, f in NS) | CLONE_NEWUSER
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER = 1, 38, 22, 36
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")

# --- seccomp -----------------------------------------------------------------------------------
# Denied with EPERM: what a program needs to leave its namespaces or attack the kernel's larger
# surfaces (new user namespaces, mounts, ptrace, keyrings, bpf, io_uring, modules, clocks, ...).
_DENY = ("ptrace mount umount2 pivot_root chroot unshare setns keyctl add_key request_key bpf "
         "perf_event_open process_vm_readv process_vm_writev kexec_load kexec_file_load "
         "init_module finit_module delete_module reboot swapon swapoff userfaultfd io_uring_setup "
         "io_uring_enter io_uring_register open_by_handle_at name_to_handle_at acct syslog "
         "pidfd_getfd open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr quotactl "
         "settimeofday clock_settime adjtimex clock_adjtime sethostname setdomainname kcmp "
         "vhangup fanotify_init").split()
_X86_64 = dict(zip(_DENY, (101, 165, 166, 155, 161, 272, 308, 250, 248, 249, 321, 298, 310, 311,
                           246, 320, 175, 313, 176, 169, 167, 168, 323, 425, 426, 427, 304, 303,
                           163, 103, 438, 428, 429, 430, 431, 432, 433, 442, 179, 164, 227, 159,
                           305, 170, 171, 312, 153, 300)), clone=56, clone3=435, socket=41)
_AARCH64 = dict(zip(_DENY, (117, 40, 39, 41, 51, 97, 268, 219, 217, 218, 280, 241, 270, 271, 104,
                            294, 105, 273, 106, 142, 224, 225, 282, 425, 426, 427, 265, 264, 89,
                            116, 438, 428, 429, 430, 431, 432, 433, 442, 60, 170, 112, 171, 266,
                            161, 162, 272, 58, 262)), clone=220, clone3=435, socket=198)
_ARCH = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}
RET_ALLOW, RET_KILL, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
LD, JEQ, JSET, JGE, RET = 0x20, 0x15, 0x45, 0x35, 0x06     # BPF_LD|W|ABS, BPF_JMP|K ..., BPF_RET|K


def seccomp_program(allow_unix_sockets):
    """Classic BPF over seccomp_data {nr@0, arch@4, ip@8, args@16}. None if the arch is unknown."""
    arch = os.uname().machine
    if arch not in _ARCH:
        return None
    audit, nr = _ARCH[arch]
    eperm, eacces, enosys = RET_ERRNO | 1, RET_ERRNO | 13, RET_ERRNO | 38
    p = [(LD, 0, 0, 4), (JEQ, 1, 0, audit), (RET, 0, 0, RET_KILL), (LD, 0, 0, 0)]
    if arch == "x86_64":        # x32 syscalls (nr | 0x40000000) would bypass the numbers below
        p += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, eperm)]
    for name in _DENY:
        p += [(JEQ, 0, 1, nr[name]), (RET, 0, 0, eperm)]
    # clone3 passes flags in memory BPF cannot read: ENOSYS makes libc fall back to clone, whose
    # flags (args[0]) we can check for new namespaces.
    p += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, enosys),
          (JEQ, 0, 3, nr["clone"]), (LD, 0, 0, 16), (JSET, 0, 1, NS_FLAGS), (RET, 0, 0, eperm),
          (LD, 0, 0, 0),
          # Sockets: none, except AF_UNIX when the mount and network namespaces make every path
          # and abstract name the program can reach its own. socketpair() stays allowed.
          (JEQ, 0, 3, nr["socket"]), (LD, 0, 0, 16),
          (JEQ, 1, 0, 1 if allow_unix_sockets else 0xFFFFFFFF), (RET, 0, 0, eacces),
          (RET, 0, 0, RET_ALLOW)]
    return b"".join(struct.pack("HBBI", *ins) for ins in p)


def load_seccomp(prog):
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    ul = ctypes.c_ulong          # a bare Python int would go through as a 32-bit C int
    return libc.prctl(PR_SET_SECCOMP, ul(2), ul(ctypes.addressof(fbuf)), ul(0), ul(0)) == 0


# --- namespaces and the minimal root ------------------------------------------------------------

def mount(src, dst, fstype, flags, data=None):
    enc = (lambda s: s.encode() if isinstance(s, str) else s)
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), "mount %s: %s" % (dst, os.strerror(ctypes.get_errno())))


def enter_userns():
    """Without root: a user namespace gives us the rights to build the other namespaces. Inside,
    we are uid 1000, not 0, so the programs lose every capability when they exec."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER) != 0:
        return False
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", "1000 %d 1" % uid),
                           ("gid_map", "1000 %d 1" % gid)):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
        return True
    except OSError:
        return False


def build_root(cfg):
    """pivot_root into a read-only tmpfs that holds the system directories (bind, read-only,
    nosuid), a few device nodes, a fresh /proc for our PID namespace and a size-capped /tmp.
    Nothing of the trainer's filesystem is visible: not /work, /root, /home, the host's /tmp,
    /run (socket files: an AF_UNIX connect reaches nothing), /sys or the datasets."""
    lim = cfg["limits"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = cfg["workdir"]
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for src in SYSTEM_DIRS + tuple(cfg["binds"]):
        dst = new + src
        if os.path.islink(src) and src.count("/") == 1:
            os.symlink(os.readlink(src), dst)            # merged /usr: /bin -> usr/bin
        elif os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
            mount(src, dst, None, MS_BIND | MS_REC)
            mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.mkdir(new + "/dev")
    for n in ("null", "zero", "full", "random", "urandom"):
        open(new + "/dev/" + n, "w").close()
        mount("/dev/" + n, new + "/dev/" + n, None, MS_BIND)
    for n, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("shm", "/tmp"),
                      ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, new + "/dev/" + n)
    os.mkdir(new + "/proc")
    try:    # hidepid: the runner cannot even list the grader or init
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(new + "/tmp")
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%dm,nr_inodes=%d,mode=1777" % (lim["disk_mb"], lim["max_files"]))
    os.chdir(new)
    os.mkdir(".old")
    if libc.syscall(155 if os.uname().machine == "x86_64" else 41, b".", b".old") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root failed")
    os.chdir("/")
    if libc.umount2(b"/.old", 2) != 0:                       # MNT_DETACH
        raise OSError(ctypes.get_errno(), "umount old root failed")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# --- the two stages -------------------------------------------------------------------------------

def send(fd, obj):
    data = json.dumps(obj).encode()
    os.write(fd, struct.pack(">I", len(data)) + data)


def start_stage(cfg, iso, role, uid, fdmap, job):
    """Fork a stage: fds 0 (its job, a memfd), 1, 2 and `fdmap` {target: fd}; nothing else."""
    data = json.dumps(job).encode()
    jobfd = os.memfd_create("job", 0)
    os.write(jobfd, data)
    os.lseek(jobfd, 0, 0)
    pid = os.fork()
    if pid:
        os.close(jobfd)
        return pid
    try:
        want = dict(fdmap)
        want[0] = jobfd
        high = {t: fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for t, fd in want.items()}
        for t, fd in high.items():
            os.dup2(fd, t)
        os.closerange(max(list(want) + [2]) + 1, 1 << 16)     # the dups above 100 too
        lim, mb, R = cfg["limits"], 1 << 20, resource
        rl = [(R.RLIMIT_CPU, lim["cpu_s"]), (R.RLIMIT_AS, lim["memory_mb"] * mb),
              (R.RLIMIT_FSIZE, lim["file_size_mb"] * mb), (R.RLIMIT_CORE, 0),
              (R.RLIMIT_NOFILE, lim["max_open_files"])]
        if uid is not None:  # NPROC counts per uid: only meaningful for a uid of its own
            rl.append((R.RLIMIT_NPROC, lim["max_processes"] if role == "runner" else 4))
        for res, v in rl:
            resource.setrlimit(res, (v, v))
        try:
            with open("/proc/self/oom_score_adj", "w") as f:   # the OOM killer takes these first
                f.write("1000")
        except OSError:
            pass
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if role == "runner":
            os.chdir("/tmp" if iso["fs"] == "minimal root" else cfg["workdir"])
        else:
            os.chdir("/")
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 and iso["no_new_privs"]:
            raise OSError("no_new_privs failed")
        prog = seccomp_program(iso["mount"] and iso["net"])
        if iso["seccomp"] and not (prog and load_seccomp(prog)):
            raise OSError("seccomp failed")
        env = dict(cfg["env"], HOME=os.getcwd(), TMPDIR=os.getcwd())
        py = cfg["python"]
        os.execve(py, [py, "-I", "-c", cfg["program"], role], env)   # -I: no env, no cwd on path
    except BaseException as e:
        os.write(2, ("sandbox setup failed (%s): %r\n" % (role, e)).encode())
    os._exit(127)


def tree_pids(pid_ns):
    """Our processes: everything in our PID namespace, else everything below us (we are the
    subreaper, so orphans come back to us) -- by /proc, since we may not trust any pid file."""
    me, kids = os.getpid(), {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    st = f.read().rsplit(b")", 1)[1].split()
                kids.setdefault(int(st[1]), []).append((int(name), int(st[21])))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [me]
    while todo:
        for pid, rss in kids.get(todo.pop(), ()):
            out.append((pid, rss))
            todo.append(pid)
    return out


def disk_usage(path, max_files):
    """Bytes under `path` without recursion; (size, files) and stops counting past max_files."""
    total, n, stack = 0, 0, [path]
    while stack and n <= max_files:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    n += 1
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        total += e.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    return total, n


def kill_tree(pid_ns):
    if pid_ns:
        try:
            os.kill(-1, signal.SIGKILL)     # PID 1 of the namespace: every process but us
        except OSError:
            pass
        return
    for _ in range(20):                      # no namespace: what descends from us, until none
        pids = tree_pids(False)
        if not pids:
            return
        for pid, _ in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
        reap()


def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def watchdog_check(cfg, iso):
    """Without a cgroup: the tree's total RSS and process count, and (without a tmpfs) disk."""
    lim, page = cfg["limits"], os.sysconf("SC_PAGE_SIZE")
    pids = tree_pids(iso["pid"])
    if sum(rss for _, rss in pids) * page > lim["memory_mb"] << 20:
        return "memory limit (watchdog on the process tree's RSS)"
    if len(pids) > lim["max_processes"] + 2:
        return "process limit (watchdog)"
    if iso["fs"] != "minimal root":
        size, files = disk_usage(cfg["workdir"], lim["max_files"])
        if size > lim["disk_mb"] << 20 or files > lim["max_files"]:
            return "disk limit (watchdog)"
    return None


def init(cfg, iso, status_fd):
    if iso["mount"] and iso["pid"]:
        try:
            build_root(cfg)
            iso["fs"] = "minimal root"
        except OSError as e:
            iso["fs_error"] = str(e)
    if iso["fs"] != "minimal root" and iso["uids"]:
        os.chown(cfg["workdir"], iso["uids"][0], iso["uids"][0])
    send(status_fd, {"iso": iso})
    fds, uids, mode = cfg["fds"], iso["uids"] or (None, None), cfg["mode"]
    stages = {}
    if mode == "serve":
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        stages[start_stage(cfg, iso, "runner", uids[0], {3: rep_w, 4: req_r},
                           cfg["runner_job"])] = "runner"
        stages[start_stage(cfg, iso, "grader", uids[1], {3: req_w, 4: rep_r, 5: fds["verdict"]},
                           cfg["grader_job"])] = "grader"
        for fd in (req_r, req_w, rep_r, rep_w, fds["verdict"]):
            os.close(fd)
    else:
        out = {3: fds["results"]} if fds.get("results") is not None else {}
        stages[start_stage(cfg, iso, "runner", uids[0], out, cfg["runner_job"])] = "runner"
        if out:
            os.close(fds["results"])
    exits, why, tick = {}, None, 0.0
    while len(exits) < len(stages):
        try:
            if cfg["watchdog"]:
                pid, st = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    time.sleep(0.02)
                    if time.monotonic() - tick > 0.1 and why is None:
                        tick = time.monotonic()
                        why = watchdog_check(cfg, iso)
                        if why:
                            kill_tree(iso["pid"])
                    continue
            else:
                pid, st = os.wait()
        except ChildProcessError:
            break
        if pid in stages:
            exits[stages[pid]] = st
            if stages[pid] == "grader" or mode != "serve":   # the verdict is in: stop the rest
                kill_tree(iso["pid"])
    kill_tree(iso["pid"])
    reap()
    send(status_fd, {"exit": exits, "watchdog": why})


def main():
    cfg = json.loads(os.read(0, 1 << 30))
    status_fd = cfg["fds"]["status"]
    for path in cfg["cgroups"]:     # first: every process we start is in the trainer's cgroup
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    iso = {k: False for k, _ in NS}
    iso.update(userns=False, fs="host", uids=None, seccomp=False, no_new_privs=True,
               cgroup_limits=bool(cfg["cgroups"]), watchdog=cfg["watchdog"])
    if cfg["isolate"]:
        if os.geteuid() == 0:
            iso["uids"] = cfg["uids"]
        else:
            iso["userns"] = enter_userns()
        if os.geteuid() == 0 or iso["userns"]:
            for name, flag in NS:
                iso[name] = libc.unshare(flag) == 0
    iso["seccomp"] = seccomp_program(False) is not None
    if iso["pid"]:
        pid = os.fork()
        if pid:        # the launcher: only waits, so that killing it kills the namespace
            os.closerange(3, 1 << 16)
            try:
                os.waitpid(pid, 0)
            finally:
                os._exit(0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        os.close(0)
        init(cfg, iso, status_fd)
    except BaseException as e:
        os.write(2, ("sandbox init failed: %r\n" % (e,)).encode())
        kill_tree(iso["pid"])
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
