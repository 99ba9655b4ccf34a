//! `inferctl`: the client of the inferd daemon (see `inferd::ctl`).

fn main() {
    inferd::ctl::main();
}
