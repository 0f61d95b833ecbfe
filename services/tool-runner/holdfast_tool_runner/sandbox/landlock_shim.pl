# Apply Landlock, then exec the command. Runs INSIDE the sandbox; see landlock.py for why
# it exists and why it is Perl. bubblewrap starts it as
#
#   /usr/bin/perl -e <this file> -- STATUS_FD ABI DENY_TCP READ WRITE DEVICES -- COMMAND...
#
# READ, WRITE and DEVICES are ':'-separated in-sandbox paths. ABI 0: the kernel has no
# Landlock, apply nothing. Writes "K" to STATUS_FD once the ruleset is enforced, or
# "E<reason>" and exits 126 without running the command. Plain syscall(): no modules, not
# even strict.pm, whose loading costs about 1 ms of every call; the tests compile this file
# under -Mstrict instead.

my ($status_fd, $abi, $deny_tcp, $read, $write, $devices, $sep, @command) = @ARGV;
open(my $status, ">&=", $status_fd) or exit 126;

sub fail {
    syswrite($status, "Elandlock: $_[0]");
    exit 126;
}
fail("usage: STATUS_FD ABI DENY_TCP READ WRITE DEVICES -- COMMAND...")
    unless defined $sep && $sep eq "--" && @command;

# syscall() passes numbers as longs and strings as pointers to their bytes.
my ($CREATE_RULESET, $ADD_RULE, $RESTRICT_SELF) = (444, 445, 446);    # on every arch
my ($EXECUTE, $WRITE_FILE, $READ_FILE, $READ_DIR) = (1 << 0, 1 << 1, 1 << 2, 1 << 3);
my ($MAKE_CHAR, $MAKE_BLOCK) = (1 << 6, 1 << 11);
my ($REFER, $TRUNCATE, $IOCTL_DEV) = (1 << 13, 1 << 14, 1 << 15);      # ABI 2, 3, 5
my $O_PATH_CLOEXEC = 010000000 | 02000000;
my $ENOENT = 2;

if ($abi > 0) {
    my $kernel = syscall($CREATE_RULESET, 0, 0, 1);    # LANDLOCK_CREATE_RULESET_VERSION
    fail("kernel Landlock ABI " . ($kernel < 0 ? "missing ($!)" : $kernel)
        . " < $abi seen by the engine") if $kernel < $abi;

    my $fs = (1 << 13) - 1;                            # ABI 1: EXECUTE .. MAKE_SYM
    $fs |= $REFER if $abi >= 2;
    $fs |= $TRUNCATE if $abi >= 3;
    $fs |= $IOCTL_DEV if $abi >= 5;
    my $net = $deny_tcp && $abi >= 4 ? 3 : 0;          # BIND_TCP | CONNECT_TCP, no rule
    my $scoped = $abi >= 6 ? 3 : 0;                    # ABSTRACT_UNIX_SOCKET | SIGNAL
    my $size = $abi < 4 ? 8 : $abi < 6 ? 16 : 24;      # struct landlock_ruleset_attr
    my $ruleset = syscall($CREATE_RULESET, substr(pack("QQQ", $fs, $net, $scoped), 0, $size),
        $size, 0);
    fail("create_ruleset: $!") if $ruleset < 0;

    # READ_DIR on "/" lets `ls /` list the mount points; file contents stay restricted.
    my @rules = (["/", $READ_DIR]);
    push @rules, map { [$_, $EXECUTE | $READ_FILE | $READ_DIR] } split(/:/, $read);
    push @rules, map { [$_, $fs & ~($MAKE_CHAR | $MAKE_BLOCK)] } split(/:/, $write);
    push @rules, map { [$_, $READ_FILE | $WRITE_FILE | $READ_DIR | $TRUNCATE | $IOCTL_DEV] }
        split(/:/, $devices);
    for my $rule (@rules) {
        my ($path, $access) = @$rule;
        unless (sysopen(my $fh, $path, $O_PATH_CLOEXEC)) {
            next if $! == $ENOENT;                     # not mounted in this sandbox
            fail("open $path: $!");
        }
        else {
            # struct landlock_path_beneath_attr (packed): u64 allowed_access, s32 parent_fd
            my $attr = pack("Qi", $access & $fs, fileno($fh));
            syscall($ADD_RULE, $ruleset, 1, $attr, 0) == 0 or fail("add_rule $path: $!");
            close($fh);
        }
    }
    # bubblewrap has set no_new_privs, which restrict_self requires.
    syscall($RESTRICT_SELF, $ruleset, 0) == 0 or fail("restrict_self: $!");
}

syswrite($status, "K");
close($status);
exec { $command[0] } @command;
print STDERR "sandbox: $command[0]: $!\n";
exit($! == $ENOENT ? 127 : 126);
