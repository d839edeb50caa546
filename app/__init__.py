"""tritonchat.app"""
