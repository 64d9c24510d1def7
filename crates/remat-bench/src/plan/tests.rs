use super::*;

#[test]
fn the_goal_compares_overheads_not_total_times() {
    // 10.1% against 10%: within 2% of the optimal overhead.
    assert!(meets_goal(0.101, 0.100));
    // 10.3% against 10%: 3% more overhead, though total times differ by 0.3%.
    assert!(!meets_goal(0.103, 0.100));
    assert_eq!(ratio_cell(0.103, 0.100), "1.0300");
    assert!(meets_goal(0.0, 0.0) && !meets_goal(0.001, 0.0));
}

#[test]
fn not_applicable_is_not_infeasible() {
    let na = PlanError::NotApplicable {
        strategy: "chain-dp".into(),
        why: "not a chain".into(),
    };
    assert_eq!(failure_label(&na), "n/a");
    let over = PlanError::OverBudget {
        strategy: "x".into(),
        budget: 1,
        best_peak: 2,
    };
    assert_eq!(failure_label(&over), "infeasible");
}
