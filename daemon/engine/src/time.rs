//! Calendar dates from Unix time, in UTC, without a time-zone database: the daemon writes them
//! in Ollama's `created_at` and in the plugin quarantine's messages.

/// The proleptic Gregorian date (year, month, day) of `days` since 1970-01-01 (Howard
/// Hinnant's civil-from-days algorithm).
pub fn civil(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// `YYYY-MM-DD HH:MM:SS` for `secs` since the epoch.
pub fn utc(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn dates_are_civil() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc(1_796_083_199), "2026-11-30 23:59:59");
        assert_eq!(utc(-1), "1969-12-31 23:59:59");
    }
}
