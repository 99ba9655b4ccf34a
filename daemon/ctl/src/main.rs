//! `inferctl`: the client of the inferd daemon (see the `inferctl` library).

fn main() {
    inferctl::main();
}
