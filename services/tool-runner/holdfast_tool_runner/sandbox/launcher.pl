# Wait, already inside the call's cgroups, for the command line to exec. Runs OUTSIDE the
# sandbox: it is what becomes bwrap; see launchers.py for why it exists. Started as
#
#   /usr/bin/perl -e <this file> CONTROL_FD
#
# and reads CONTROL_FD to EOF: NUL-terminated fields, the first a comma-separated list of
# inherited fds to close (those this call does not use), then the argv, then "END". Anything
# else (EOF first because the runner closed it or died, a message cut short) exits 0 without
# running anything. Plain built-ins, no modules (the tests compile it under -Mstrict).

my $control_fd = shift;
open(my $control, "<&=", $control_fd) or exit 125;
my $message = do { local $/; <$control> };
close($control);
exit 0 unless defined $message && length $message;

my @fields = split(/\0/, $message, -1);
pop @fields;                                # after the last terminator
exit 0 unless @fields >= 3 && pop(@fields) eq "END";
my ($unused, @argv) = @fields;
for my $fd (split(/,/, $unused)) {
    if (open(my $fh, "<&=", $fd)) { close($fh) }
}
exec { $argv[0] } @argv;
print STDERR "sandbox launcher: exec $argv[0]: $!\n";
exit 127;
